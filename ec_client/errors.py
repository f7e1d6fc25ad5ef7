"""`EcdError`, under the name users import it by: it is declared in ec_protocol.errors, which the
daemon shares; this module names the same object."""

from ec_protocol.errors import *  # noqa: F403
