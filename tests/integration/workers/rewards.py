"""Reward functions used by the integration tests, importable by dotted name from worker processes."""


def picky_reward(response_text: str, answer: str) -> float:
    """1 for the right answer; raises on "99", like a parser that meets an unexpected format; +inf for "98", like
    a log-likelihood reward that overflows."""
    if response_text == "98":
        return float("inf")
    if response_text == "99":
        raise ValueError(f"cannot parse {response_text!r}")
    return float(response_text == answer)
