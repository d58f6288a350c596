"""Transports: how bytes move. Every backend implements the contract in ``base``."""
