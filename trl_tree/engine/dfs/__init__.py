"""Depth-first tree walk (AREAL-DTA style): K/V stack, memory bounded by the longest path."""
