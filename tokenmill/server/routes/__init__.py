"""Thin HTTP routes over `server.serving.Serving`, one module per API area."""
