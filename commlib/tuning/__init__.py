"""Config tuning: ``cache`` (looked up by the Buffer), ``search`` (strategies over a space of
Configs) and ``autotune`` (times a Buffer; above it). ``python -m commlib.tuning`` runs the search."""
