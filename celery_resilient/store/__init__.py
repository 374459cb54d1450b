"""Layer 3, the store: every SQL statement of the library, behind ``Store`` (SQLAlchemy 2;
SQLite embedded, PostgreSQL in production), with its schema and Alembic migrations."""
