"""The fd channel's tickets (ec_daemon/server/fd_channel.py): what OpenPool promises a granted
session, good once and for TICKET_TTL_S."""

from __future__ import annotations

from ec_daemon.server.fd_channel import TICKET_TTL_S, Ticket, Tickets


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_ticket_names_the_session_and_pool_file_it_was_issued_for_once() -> None:
    clock = Clock()
    tickets = Tickets(clock)
    ticket = tickets.issue("session", "pool", "uuid")
    assert tickets.redeem(ticket) == Ticket(100.0 + TICKET_TTL_S, "session", "pool", "uuid")
    assert tickets.redeem(ticket) is None


def test_a_ticket_not_redeemed_in_time_is_forgotten() -> None:
    clock = Clock()
    tickets = Tickets(clock)
    late = tickets.issue("session", "pool", "uuid")
    clock.now += TICKET_TTL_S / 2
    in_time = tickets.issue("session", "pool", "uuid")
    clock.now += TICKET_TTL_S / 2
    assert tickets.redeem(late) is None
    assert len(tickets) == 1  # the expired one is gone, not merely refused
    assert tickets.redeem(in_time) is not None


def test_tickets_are_unguessable_and_distinct() -> None:
    tickets = Tickets(Clock())
    issued = {tickets.issue("session", "pool", "uuid") for _ in range(100)}
    assert len(issued) == 100
    assert all(len(t) >= 32 for t in issued)
    assert tickets.redeem("made-up") is None
