"""The MySQL dialect's pure parts: which servers it accepts, and the order of an upsert's
assignments (MySQL assigns left to right, each seeing the columns already assigned)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, case
from sqlalchemy.dialects import mysql

from celery_resilient.errors import ConfigurationError
from celery_resilient.store.dialect import Dialect, check_server
from celery_resilient.store.liveness_mysql import same_server


@pytest.mark.parametrize(("version", "mariadb", "ok"), [
    ((10, 6, 0), True, True), ((10, 11, 19, "MariaDB"), True, True), ((10, 5, 25), True, False),
    ((8, 0, 1), False, True), ((8, 4, 3), False, True), ((5, 7, 44), False, False),
])
def test_servers_without_skip_locked_are_refused_by_version(
        version: tuple[object, ...], mariadb: bool, ok: bool) -> None:
    dialect = SimpleNamespace(server_version_info=version, is_mariadb=mariadb)
    if ok:
        check_server(dialect)
        return
    with pytest.raises(ConfigurationError) as err:
        check_server(dialect)
    shown = ".".join(str(v) for v in version if isinstance(v, int))
    assert shown in str(err.value) and ("10.6" if mariadb else "8.0.1") in str(err.value)


def test_mariadb_urls_are_the_mysql_dialect() -> None:
    assert Dialect("mariadb").name == Dialect("mysql").name == "mysql"


def _table() -> Table:
    return Table("t", MetaData(), Column("k", String(8), primary_key=True),
                 Column("state", String(8)), Column("owner", String(8)), Column("n", Integer))


def test_a_column_other_assignments_read_is_assigned_last() -> None:
    t = _table()
    ins = Dialect("mysql").insert(t).values(k="a", state="r", owner="me", n=1)
    stmt = ins.on_conflict_do_update(index_elements=[t.c.k], set_={
        "state": case((t.c.state == "r", "r"), else_=t.c.state),
        "owner": case((t.c.state == "r", ins.excluded.owner), else_=t.c.owner),
        "n": t.c.n + 1,
    })
    sql = str(stmt.compile(dialect=mysql.dialect()))
    update = sql.split("ON DUPLICATE KEY UPDATE", 1)[1]
    assert update.index(" owner = ") < update.index(", n = ") < update.index(", state = ")


def test_assignments_that_read_each_other_are_refused() -> None:
    t = _table()
    ins = Dialect("mysql").insert(t).values(k="a", state="r", owner="me", n=1)
    with pytest.raises(ValueError, match="read each other's column"):
        ins.on_conflict_do_update(index_elements=[t.c.k], set_={
            "state": case((t.c.owner == "x", "r"), else_=t.c.state),
            "owner": case((t.c.state == "r", "y"), else_=t.c.owner),
        })


def test_a_server_start_names_one_node_within_a_second() -> None:
    """Two reads of one node's start differ by whole seconds (Uptime ticks apart from the
    clock); another node's fraction, or a restart, is another server."""
    start = 1_796_582_278 + 0.421
    assert same_server(start, start) and same_server(start + 1, start)
    assert not same_server(start + 2, start), "a restart"
    assert not same_server(start + 0.001, start), "another node started the same second"
    assert not same_server(start - 3600, start)


def test_a_chain_of_reads_is_assigned_readers_first() -> None:
    t = _table()
    ins = Dialect("mysql").insert(t).values(k="a", state="r", owner="me", n=1)
    stmt = ins.on_conflict_do_update(index_elements=[t.c.k], set_={
        "n": case((t.c.owner == "x", 0), else_=t.c.n),  # reads owner
        "state": case((t.c.state == "r", "s"), else_=t.c.state),
        "owner": case((t.c.state == "r", "y"), else_=t.c.owner),  # reads state
    })
    update = str(stmt.compile(dialect=mysql.dialect())).split("ON DUPLICATE KEY UPDATE", 1)[1]
    assert update.index(" n = ") < update.index(", owner = ") < update.index(", state = ")
