import threading, traceback, sys
import loader.source.plan as plan
LOG = []
real_let_go = plan.PlanFiles.let_go
def let_go(self, ks):
    before = {k: self.fds[k] for k in ks}
    real_let_go(self, ks)
    closed = [k for k in ks if before[k] >= 0 and self.fds[k] < 0]
    if closed:
        LOG.append(("close", threading.current_thread().name, closed, dict(self.users), "".join(traceback.format_stack(limit=4)[:-1])))
plan.PlanFiles.let_go = let_go
real_ensure = plan.PlanFiles.ensure
def ensure(self, ks, **kw):
    real_ensure(self, ks, **kw)
    LOG.append(("ensure", threading.current_thread().name, list(ks), kw.get("use", True), dict(self.users)))
plan.PlanFiles.ensure = ensure
import atexit
def dump():
    for e in LOG[-60:]:
        print(e, file=sys.stderr)
atexit.register(dump)
