"""SQLite persistence: ``db.py`` owns the connection and migrations; one module per table."""
