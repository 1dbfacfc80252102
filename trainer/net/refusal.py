"""A request the coordinator will not serve, and the typed reason why.

The state machine (trainer.coordinator) and the trust gate (settlement.gate) say *why* they refuse
with a :class:`Reason`; only the gRPC service (trainer.coordinator.service) turns a reason into a
status code, so the round logic knows nothing of transport and its tests assert reasons.
"""

from __future__ import annotations

import enum


class Reason(enum.Enum):
    """Why a request was refused. The service maps each to one gRPC status code."""

    # the request is malformed or claims what the run does not allow (INVALID_ARGUMENT)
    MALFORMED = "malformed"            # a field, payload, codec header or report that does not parse or fit
    BAD_CLAIM = "bad-claim"            # tokens, steps, loss or report fields other than the run's own
    REPLAYED = "replayed"              # byte-identical to an update already accepted in the run
    SCREENED_OUT = "screened-out"      # the update raises the held-out loss beyond the margin
    # the request does not fit the run's state now (FAILED_PRECONDITION)
    PROTOCOL = "protocol"              # a protocol version this coordinator does not speak
    WRONG_RUN = "wrong-run"            # for another run
    FINISHED = "finished"              # the run has published all its rounds
    STALE_ROUND = "stale-round"        # the round has closed
    ROUND_NOT_OPEN = "round-not-open"  # the round has not opened yet
    WRONG_BASE = "wrong-base"          # computed from no checkpoint or not the round's start
    HALTED = "halted"                  # the coordinator stopped the run: it cannot go on (named)
    NOT_PUBLISHED = "not-published"    # a report of a round without a published checkpoint, or too late
    NOT_PARTICIPANT = "not-participant"  # a report of a round the worker did not contribute to
    NO_LEDGER = "no-ledger"            # reports sent to a run without a ledger
    BAD_NONCE = "bad-nonce"            # a join nonce not issued to this id, expired or spent
    # who is asking (UNAUTHENTICATED / PERMISSION_DENIED)
    NO_SESSION = "no-session"          # a call acting for a worker without that worker's session token
    BAD_SIGNATURE = "bad-signature"    # a push or report not signed by the worker's admitted key
    NO_EVIDENCE = "no-evidence"        # a Join without attestation evidence where the run requires it
    UNKNOWN_WORKER = "unknown-worker"  # an id that has not joined the run
    NOT_ADMITTED = "not-admitted"      # evidence refused by policy, measurement not allowed, no admitted key
    # contention (ALREADY_EXISTS / RESOURCE_EXHAUSTED / UNAVAILABLE)
    DUPLICATE = "duplicate"            # what the request repeats is held already
    ID_HELD = "id-held"                # a live worker holds this id
    REGISTRY_FULL = "registry-full"    # every remembered worker id is live or contributing
    CHAIN_UNAVAILABLE = "chain-unavailable"  # the chain cannot be reached to admit a key now

    @property
    def files(self) -> bool:
        """Whether a push refused for this reason is filed against the worker's round: a duplicate
        repeats something that is held, so nothing changes."""
        return self is not Reason.DUPLICATE


class Refusal(Exception):
    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
