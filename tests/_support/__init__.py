"""Helpers the test modules share (not tests themselves: pytest collects nothing here)."""
