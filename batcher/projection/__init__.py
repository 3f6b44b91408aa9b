"""Exact projection of the batch weight into the future.

Every running request grows by one token per step until it reaches its reserved length, then leaves.
Between finishes the total only grows, so the peaks sit at finish steps: the weight at each finish
point gives the exact maximum, with no step loop.

Steps are absolute (steps completed since the batcher started), so a profile stays valid while the
running set is unchanged: a decoding request's weight at step T is `offset + T` whatever T is now.
That is also what lets a profile be updated in place: adding or removing one request changes the
weight only at the finish points it lives through, and nothing else has to be recomputed.
"""

from .entry import Entry, ceil_to
from .hybrid import HybridProfile
from .padded import PaddedProfile
from .token import TokenProfile

__all__ = ["Entry", "HybridProfile", "PaddedProfile", "TokenProfile", "ceil_to"]
