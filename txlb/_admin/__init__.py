"""
The admin port: the Klein app, its guard against web pages, and the dashboard's history.
"""
