"""ecd's protocol and pool format, shared by the daemon (ec_daemon) and its clients
(ec_client), importing neither: the generated protobuf modules, the API's values, errors,
units, the default address, the token file, and the pool file's layout and locks."""

# The distribution's version (pyproject reads it here): the daemon reports it without loading the
# client library.
__version__ = "0.1.0"
