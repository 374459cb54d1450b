"""A value larger than the MySQL server's ``max_allowed_packet`` is bad input, not an outage.

The server drops such a packet (error 1153, or the connection when the client is still
writing it: 2006), which read as a store outage and re-sent the task for ever. The store now
measures each statement as the driver sends it and refuses it with :class:`PayloadTooLarge`
before anything is written; the connection stays usable, and values under the limit pass.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pymysql.converters import escape_item  # type: ignore[import-untyped]
from sqlalchemy import text

from celery_resilient.core import codec
from celery_resilient.errors import PayloadTooLarge, StoreUnavailable
from celery_resilient.store import packet_limit
from celery_resilient.store.batched_takes import TakeRequest
from celery_resilient.store.sql import Store
from celery_resilient.tasks.ledger import Ledger

from .helpers import execution, owner, run, started, take

MiB = 1024 * 1024


@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=300))
@settings(max_examples=300, deadline=None)
def test_the_size_counted_is_the_size_the_driver_sends(value: str) -> None:
    """Every character class the escaping touches (quotes, backslashes, NUL, newlines,
    ^Z) and every UTF-8 width: the count is PyMySQL's literal, byte for byte."""
    assert packet_limit._sent_size(value) == len(escape_item(value, "utf8mb4").encode())
    assert packet_limit._bound(value) >= packet_limit._sent_size(value)


def test_an_executemany_is_judged_row_by_row() -> None:
    rows = [{"m": "x" * 600}, {"m": "y" * 600}]
    packet_limit.check("INSERT INTO t VALUES (%(m)s)", rows, True, 1000)  # each row fits
    with pytest.raises(PayloadTooLarge, match="over the MySQL server's max_allowed_packet"):
        packet_limit.check("INSERT INTO t VALUES (%(m)s)", [*rows, {"m": "z" * 990}], True, 1000)


def _limit(store: Store) -> int:
    with store.engine.connect() as conn:
        value = int(conn.execute(text("SELECT @@max_allowed_packet")).scalar_one())
        conn.rollback()
    return value


def test_an_oversized_result_is_refused_and_the_claim_stays_open(mysql_store: Store) -> None:
    who = owner()
    claim = run(mysql_store, "big-result", who)
    limit = _limit(mysql_store)
    with pytest.raises(PayloadTooLarge, match=rf"'Store\.finish'.*max_allowed_packet of {limit:,}"):
        mysql_store.finish("big-result", claim.epoch, json.dumps("x" * limit))
    row = mysql_store.get_work("big-result")
    assert row is not None and row.state == "running" and row.result_json is None
    # the same pooled connections go on: a result just under the limit is stored
    fits = json.dumps("x" * (limit - 4096))
    mysql_store.finish("big-result", claim.epoch, fits)
    row = mysql_store.get_work("big-result")
    assert row is not None and row.state == "done" and row.result_json == fits


def test_an_oversized_message_takes_no_claim(mysql_store: Store) -> None:
    limit = _limit(mysql_store)
    big = json.dumps({"body": "a" * limit})
    with pytest.raises(PayloadTooLarge, match=r"'Store\.take'"):
        mysql_store.take("big-args", "proj.task", "tid-big", None, owner(), 30.0, 5,
                      lambda *_: True, message_if_new=lambda: big)
    assert mysql_store.get_work("big-args") is None
    assert take(mysql_store, "big-args", owner()).action == "run"  # nothing half-written


def test_text_outside_the_bmp_is_measured_after_both_escapings(mysql_store: Store) -> None:
    """A step result of 5.2 MB of UTF-8 emoji: JSON escapes each as 12 characters and the
    driver doubles their backslashes, 17 MiB on the wire: refused, not dropped by the
    server. Before the step nothing is written, and the work can still finish."""
    who = owner()
    claim = run(mysql_store, "emoji", who)
    value = codec.encode("\N{GRINNING FACE}" * 1_300_000, "result of step 'emoji'")
    assert len(value.encode()) < 16 * MiB < packet_limit._sent_size(value)
    with pytest.raises(PayloadTooLarge, match=r"'Store\.put_step'"):
        mysql_store.put_step("emoji", claim.epoch, "emoji", value)
    assert mysql_store.get_step("emoji", "emoji") is None
    mysql_store.finish("emoji", claim.epoch, json.dumps("ok"))
    row = mysql_store.get_work("emoji")
    assert row is not None and row.state == "done"


def test_the_refusal_is_not_an_outage(mysql_store: Store) -> None:
    """What made the task re-send itself for ever: the error must not be StoreUnavailable."""
    claim = run(mysql_store, "not-outage", owner())
    state = json.dumps("c" * _limit(mysql_store))
    with pytest.raises(PayloadTooLarge) as caught:
        mysql_store.save_checkpoint("not-outage", claim.epoch, state)
    assert not isinstance(caught.value, StoreUnavailable)
    assert isinstance(caught.value, ValueError)


def test_a_batch_leaves_an_oversized_message_to_its_careful_take(mysql_store: Store) -> None:
    """The batched takes send on the driver's own cursor, which no listener sees: the batch
    measures each new key's message itself and leaves one over the limit untaken (its pool
    process's careful take refuses it by name); the rest of the batch is taken."""
    limit = _limit(mysql_store)
    me = started(mysql_store, owner())
    big = TakeRequest("big", "proj.task", "tid-big", 0, None, None, "m" * limit)
    small = TakeRequest("small", "proj.task", "tid-small", 0, None, None, '{"m": 1}')
    claims, _ = mysql_store.take_batch([big, small], [], me, 30.0, 5)
    assert set(claims) == {"small"}
    assert mysql_store.get_work("big") is None
    with pytest.raises(PayloadTooLarge, match=r"'Store\.take'"):
        mysql_store.take("big", "proj.task", "tid-big", None, me, 30.0, 5, lambda *_: True,
                      message_if_new=lambda: big.message_json)


def test_a_value_written_twice_by_one_statement_is_counted_twice() -> None:
    sql = "UPDATE t SET a = %(v)s, b = IF(%(v)s IS NULL, 1, 0) WHERE k = %(k)s"
    packet_limit.check(sql, {"v": "x" * 300, "k": "key"}, False, 1000)
    with pytest.raises(PayloadTooLarge):
        packet_limit.check(sql, {"v": "x" * 600, "k": "key"}, False, 1000)
    # a value the statement does not name is not sent
    packet_limit.check("SELECT %(k)s", {"k": "key", "unused": "x" * 5000}, False, 1000)


def test_a_checkpoint_the_save_writes_three_times_is_refused_not_dropped(
        mysql_store: Store) -> None:
    """MySQL's checkpoint save writes its state in its SET and in two CASEs (did it change?):
    6 MiB of state is 18 MiB on the wire. Refused by name, the previous checkpoint kept."""
    claim = run(mysql_store, "triple", owner())
    assert mysql_store.save_checkpoint("triple", claim.epoch, json.dumps({"row": 1})) == 1
    with pytest.raises(PayloadTooLarge, match="max_allowed_packet"):
        mysql_store.save_checkpoint("triple", claim.epoch, json.dumps("s" * (6 * MiB)))
    assert mysql_store.load_checkpoint("triple") == (json.dumps({"row": 1}), 1)


def test_an_atomic_block_statement_using_a_value_twice_is_refused(mysql_store: Store) -> None:
    """The user's own SQL in ``ledger.atomic()``, one bound value used twice (9 MiB, 18 on
    the wire): PayloadTooLarge, the block and its marker rolled back, not a store outage."""
    claim = run(mysql_store, "atomic-twice", owner())
    x = execution(mysql_store, claim)
    with mysql_store.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {mysql_store.prefix}notes (v LONGTEXT)"))
    with pytest.raises(PayloadTooLarge), Ledger(mysql_store, x).atomic("note") as tx:
        tx.execute(text(f"INSERT INTO {mysql_store.prefix}notes (v) "
                        "VALUES (IF(:v IS NULL, '', :v))"), {"v": "n" * (9 * MiB)})
    with mysql_store.engine.connect() as conn:
        count = conn.execute(text(f"SELECT COUNT(*) FROM {mysql_store.prefix}notes")).scalar_one()
        conn.rollback()
    assert count == 0 and mysql_store.ledger_get("note") is None
    with Ledger(mysql_store, x).atomic("note") as tx:  # the same block, a value that fits
        tx.execute(text(f"INSERT INTO {mysql_store.prefix}notes (v) "
                        "VALUES (IF(:v IS NULL, '', :v))"), {"v": "small"})
    assert mysql_store.ledger_get("note") is not None
