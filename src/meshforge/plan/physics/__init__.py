"""The physics: what a rank holds and computes, its memory and its step time."""
