"""The API's values, under the name users import them by: they are declared once, in
ec_protocol.types, which the daemon shares; this module names the same objects."""

from ec_protocol.types import *  # noqa: F403
