"""Headless-Chromium helpers for the dashboard tests (``harness``)."""
