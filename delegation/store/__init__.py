"""Persistence: the only package that imports SQLAlchemy."""
