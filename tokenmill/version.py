"""The package version, at the bottom layer so any module can name it without
importing tokenmill/__init__.py (which sits on top: it re-exports LLM)."""

__version__ = "0.1.0"
