"""Small helpers shared by both roles (no envhub imports of their own)."""
