"""Shared by every test module: this directory is on ``sys.path`` (pytest's prepend import
mode puts a conftest's directory there), so modules here, such as ``contracts``, import by
name from any subdirectory."""
