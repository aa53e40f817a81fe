"""
The admin port: the Klein app, its guard against web pages, and the dashboard's history.
"""

#: The admin API's cap on a request body.  Kept here, outside the Klein app, so that
#: ``txlb.tap`` can read it without importing Klein -- which imports the reactor, and the
#: plugin must choose the reactor before anything does (``txlb._server.reactor``).
ADMIN_MAX_BODY = 64 * 1024
