"""One request's speculative-decoding state (see speculative.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from radixrt.memory.draft_index import OwnTokens

DECAY = 0.7  # weight of a request's earlier verifications in its calibration
CALIBRATION_RANGE = (0.25, 2.0)
# the server-wide calibration counts as this many expected draft tokens of a request's own evidence
PRIOR_WEIGHT = 2.0
SERVER_DECAY = 0.995  # weight of the server's earlier verifications in the server-wide calibration
# weight of the evidence per step in which a request (or, for the server's, every request) verified no
# draft: a calibration low enough to stop all drafting would otherwise never hear of better drafts, so
# old evidence fades and confident drafts are tried again (about every 20 idle steps at worst)
IDLE_DECAY = 0.97


@dataclass
class SpecState:
    """One request's speculation: its own tokens indexed, how well the draft
    index's acceptance estimates held for it, and what it reports
    (``spec_verify_ct``: its decode steps since it started speculating, each
    verifying a draft, possibly empty)."""

    own: "OwnTokens"
    synced: int  # tokens of input_ids + output_ids already in ``own``
    # decayed sums over its verifications: draft tokens accepted, and the index's expectation of them
    accepted: float = 0.0
    expected: float = 0.0
    pending_expected: float = 0.0  # the expectation of the draft being verified now
    drafting: bool = False  # the request's draft_ids are this speculation's (not a grammar's jump-forward)
    # the draft's tree: parents[i] is the index in draft_ids of draft token i's parent, -1 for a child of
    # the request's last token (a parent before its children); None: the draft is a chain
    parents: "Optional[list[int]]" = None
    verify_ct: int = 0
    drafted: int = 0  # draft tokens verified so far (SGLang's spec_num_proposed_drafts)
    kept: int = 0  # of them, those accepted (spec_num_correct_drafts)

    def calibration(self, prior: float = 1.0) -> float:
        """Accepted over expected draft tokens, starting from ``prior`` (the server's
        ratio: a new request, or one with little evidence, is calibrated as the
        others were), clamped."""
        lo, hi = CALIBRATION_RANGE
        return min(hi, max(lo, (self.accepted + PRIOR_WEIGHT * prior) / (self.expected + PRIOR_WEIGHT)))

    def record(self, kept: int) -> None:
        """The draft in flight was verified: ``kept`` of its tokens accepted."""
        self.accepted = DECAY * self.accepted + kept
        self.expected = DECAY * self.expected + self.pending_expected
        self.cancel()

    def age(self) -> None:
        """A step without a draft of its own: its evidence fades (`IDLE_DECAY`)."""
        self.accepted *= IDLE_DECAY
        self.expected *= IDLE_DECAY

    def cancel(self) -> None:
        """The draft in flight is gone (verified, or dropped before computing)."""
        self.pending_expected = 0.0
        self.drafting = False
        self.parents = None


@dataclass
class ServerCalibration:
    """Accepted over expected draft tokens across all requests (decayed sums): the
    prior of each request's calibration. The index's estimates of the drafts a
    large batch can afford (only its most confident) run high, and a request's
    own few verifications there cannot tell it so."""

    accepted: float = 0.0
    expected: float = 0.0

    @property
    def ratio(self) -> float:
        lo, hi = CALIBRATION_RANGE
        return min(hi, max(lo, (self.accepted + 1.0) / (self.expected + 1.0)))

    def record(self, kept: int, expected: float) -> None:
        self.accepted = SERVER_DECAY * self.accepted + kept
        self.expected = SERVER_DECAY * self.expected + expected

    def age(self) -> None:
        """A step in which no request drafted: the evidence fades (`IDLE_DECAY`)."""
        self.accepted *= IDLE_DECAY
        self.expected *= IDLE_DECAY
