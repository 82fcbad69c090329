"""The database: engine and migrations, tables, CRUD."""
