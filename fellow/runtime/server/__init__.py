"""The bus side of a stage process, once for local and ring stages: connect, report, intake, shutdown."""
