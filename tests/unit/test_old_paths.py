"""The import paths users put in configs and scripts keep working after the base moved to
ec_protocol (docs/design.md §2): `ec_client.types` and `ec_client.errors` name the very objects
ec_protocol declares, so a value or an error caught under either name is the same."""

from __future__ import annotations

import ec_client
import ec_client.errors
import ec_client.types
import ec_protocol.errors
import ec_protocol.types


def test_ec_client_types_names_every_value_of_the_api() -> None:
    public = [name for name in dir(ec_protocol.types) if not name.startswith("_")]
    assert public
    assert [
        name
        for name in public
        if getattr(ec_client.types, name, None) is not getattr(ec_protocol.types, name)
    ] == []


def test_ec_client_errors_and_ec_client_name_the_one_ecd_error() -> None:
    assert ec_client.errors.EcdError is ec_protocol.errors.EcdError
    assert ec_client.EcdError is ec_protocol.errors.EcdError
