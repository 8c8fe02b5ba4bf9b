// seqgen: the reference data generator shipped with shardgen (a stand-in for a user's own binary).
//
//   seqgen --date YYYY-MM-DD --out PATH [--rows N] [--cols N] [--targets K] [--seed N] [--work-ms MS]
//
// Writes one float32 2-D .npy of shape (rows, cols) for the date: cols - K feature columns, then
// K target columns (forward log-returns of asset 0 over horizons 1, 5, 10, 20, 60, ...).
// Features come from a few correlated random-walk assets (a market factor plus noise): per asset
// the 1-step return, the log price since the open, log volume and an EWMA volatility, in turn.
// Output is deterministic per (date, seed); the row count varies by date unless --rows is given.
// The file is written to a temp name and renamed, so a reader never sees half a file.
// Exit codes: 0 ok, 2 bad arguments, 1 I/O failure; a one-line message on stderr.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <unistd.h>

namespace {

uint64_t splitmix(uint64_t &s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

struct Rng {  // xorshift-free, portable: splitmix64 + Box-Muller (same numbers on every platform)
  uint64_t state;
  double spare = 0;
  bool has_spare = false;
  double uniform() { return ((splitmix(state) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  double normal() {
    if (has_spare) { has_spare = false; return spare; }
    double u = uniform(), v = uniform();
    double r = std::sqrt(-2.0 * std::log(u));
    spare = r * std::sin(2 * M_PI * v);
    has_spare = true;
    return r * std::cos(2 * M_PI * v);
  }
};

[[noreturn]] void usage(const std::string &msg) {
  std::fprintf(stderr, "seqgen: %s\nusage: seqgen --date YYYY-MM-DD --out PATH [--rows N] [--cols N] "
               "[--targets K] [--seed N] [--work-ms MS]\n", msg.c_str());
  std::exit(2);
}

bool parse_date(const std::string &s, int &y, int &m, int &d) {
  if (s.size() != 10 || s[4] != '-' || s[7] != '-') return false;
  for (int i : {0, 1, 2, 3, 5, 6, 8, 9}) if (s[i] < '0' || s[i] > '9') return false;
  y = std::atoi(s.substr(0, 4).c_str()); m = std::atoi(s.substr(5, 2).c_str()); d = std::atoi(s.substr(8, 2).c_str());
  static const int mdays[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  if (m < 1 || m > 12 || d < 1) return false;
  bool leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
  return d <= mdays[m - 1] + (m == 2 && leap ? 1 : 0);
}

long parse_int(const std::string &flag, const char *text, long lo, long hi) {
  char *end = nullptr;
  long v = std::strtol(text, &end, 10);
  if (!*text || *end || v < lo || v > hi)
    usage(flag + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + text + "'");
  return v;
}

bool write_npy(const std::string &path, const std::vector<float> &data, long rows, long cols) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(rows) + ", " +
                       std::to_string(cols) + "), }";
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::string tmp = path + ".tmp." + std::to_string(getpid());
  FILE *f = std::fopen(tmp.c_str(), "wb");
  if (!f) return false;
  const unsigned char magic[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  uint16_t hlen = static_cast<uint16_t>(header.size());
  bool ok = std::fwrite(magic, 1, 8, f) == 8 && std::fwrite(&hlen, 2, 1, f) == 1 &&
            std::fwrite(header.data(), 1, header.size(), f) == header.size() &&
            std::fwrite(data.data(), sizeof(float), data.size(), f) == data.size();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) { std::remove(tmp.c_str()); return false; }
  return true;
}

}  // namespace

int main(int argc, char **argv) {
  std::string date, out;
  long rows = -1, cols = 37, targets = 5, seed = 0, work_ms = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") usage("reference generator for shardgen");
    if (i + 1 >= argc) usage("missing value for " + a);
    const char *v = argv[++i];
    if (a == "--date") date = v;
    else if (a == "--out") out = v;
    else if (a == "--rows") rows = parse_int(a, v, 1, 10000000);
    else if (a == "--cols") cols = parse_int(a, v, 2, 100000);
    else if (a == "--targets") targets = parse_int(a, v, 1, 1000);
    else if (a == "--seed") seed = parse_int(a, v, 0, 1L << 40);
    else if (a == "--work-ms") work_ms = parse_int(a, v, 0, 3600 * 1000);
    else usage("unknown argument " + a);
  }
  int y, m, d;
  if (date.empty() || !parse_date(date, y, m, d)) usage("--date expects a valid YYYY-MM-DD, got '" + date + "'");
  if (out.empty()) usage("--out is required");
  if (targets >= cols) usage("--targets must be smaller than --cols");

  uint64_t s = static_cast<uint64_t>(seed) * 1000003ULL + static_cast<uint64_t>(y * 10000 + m * 100 + d);
  Rng rng{splitmix(s)};
  if (rows < 0) rows = 1600 + static_cast<long>(splitmix(s) % 800);  // varies by date

  const long features = cols - targets;
  const long assets = std::max(1L, (features + 3) / 4);
  std::vector<long> horizons;
  const long base[] = {1, 5, 10, 20, 60};
  for (long k = 0; k < targets; ++k) horizons.push_back(k < 5 ? base[k] : 60 + 20 * (k - 4));
  const long hmax = horizons.back();
  const long steps = rows + hmax;

  std::vector<double> beta(assets), vol(assets, 0.01), logp(assets, 0.0);
  for (long a = 0; a < assets; ++a) beta[a] = 0.5 + rng.uniform();
  std::vector<double> ret(steps * assets), price(steps * assets), volume(steps * assets), ewv(steps * assets);
  double regime = 0.008 + 0.006 * rng.uniform();  // a calmer or busier day
  for (long t = 0; t < steps; ++t) {
    double mkt = rng.normal();
    for (long a = 0; a < assets; ++a) {
      double r = regime * (beta[a] * mkt + rng.normal()) / std::sqrt(1 + beta[a] * beta[a]);
      logp[a] += r;
      vol[a] = std::sqrt(0.94 * vol[a] * vol[a] + 0.06 * r * r);
      long i = t * assets + a;
      ret[i] = r * 100;
      price[i] = logp[a] * 100;
      volume[i] = 8 + 40 * std::fabs(r) + 0.3 * rng.normal();
      ewv[i] = vol[a] * 100;
    }
  }
  std::vector<float> data(static_cast<size_t>(rows) * cols);
  for (long t = 0; t < rows; ++t) {
    float *row = &data[static_cast<size_t>(t) * cols];
    for (long f = 0; f < features; ++f) {
      long a = f % assets, kind = (f / assets) % 4, i = t * assets + a;
      row[f] = static_cast<float>(kind == 0 ? ret[i] : kind == 1 ? price[i] : kind == 2 ? volume[i] : ewv[i]);
    }
    for (long k = 0; k < targets; ++k) {
      row[features + k] = static_cast<float>(price[(t + horizons[k]) * assets] - price[t * assets]);
    }
  }
  if (work_ms > 0) {  // a generator that costs real CPU time per date (benchmarks)
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(work_ms);
    volatile double sink = 0;
    while (std::chrono::steady_clock::now() < until) {
      for (int k = 0; k < 10000; ++k) sink = sink + std::sqrt(static_cast<double>(k));
    }
  }
  if (!write_npy(out, data, rows, cols)) {
    std::fprintf(stderr, "seqgen: %s: cannot write %s (%s)\n", date.c_str(), out.c_str(), std::strerror(errno));
    return 1;
  }
  return 0;
}
