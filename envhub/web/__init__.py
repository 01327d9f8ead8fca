"""HTTP layer: one blueprint module per resource, plus errors.py and auth.py.

Handlers parse the request, make one call into the core and return JSON.
"""
