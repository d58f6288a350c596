"""Helpers every layer may use: env (the only reader of COMMLIB_* variables), event, errors, math,
timing, dist and launch (process groups, spawning local ranks). Nothing here imports the rest of
commlib."""
