"""``shardgen status``'s lag: days from the store's last date to today (issue 45: ``.days + 1``
passed every test)."""

import datetime as dt

from conftest import make_store

from shardgen.store.status import status


def test_lag_is_the_days_from_the_last_date_to_today(tmp_path):
    make_store(tmp_path / "s", {"2024-03-01": 10, "2024-03-04": 10})
    assert status(tmp_path / "s", today=dt.date(2024, 3, 4))["lag_days"] == 0
    assert status(tmp_path / "s", today=dt.date(2024, 3, 7))["lag_days"] == 3
