"""SQL projections: tables, engine, migrations."""
