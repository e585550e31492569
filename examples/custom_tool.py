"""A tool of your own: subclass Tool, describe its arguments (JSON schema), register it.

Its dataclass fields are its parameters; `run` returns the text the policy reads or raises
ToolError with the message it should read instead. It runs inside the trainer (not in the python
sandbox), so it must bound its own work: here, the size of n.

    stapo tools --import examples/custom_tool.py
"""

from stapo.tools import Tool, ToolError, register_tool


@register_tool("prime_factors")
class PrimeFactors(Tool):
    """Prime factorization of an integer (trial division up to sqrt(max_n))."""

    description = "Factor an integer n >= 2 into primes, e.g. 360 -> 2^3 * 3^2 * 5."
    parameters = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    max_n: int = 10**12

    def run(self, arguments, session):
        n = arguments["n"]
        if not 2 <= n <= self.max_n:
            raise ToolError(f"n must be between 2 and {self.max_n}, got {n}")
        factors, p = {}, 2
        while p * p <= n:
            while n % p == 0:
                factors[p], n = factors.get(p, 0) + 1, n // p
            p += 1
        if n > 1:
            factors[n] = factors.get(n, 0) + 1
        return " * ".join(f"{p}^{e}" if e > 1 else str(p) for p, e in factors.items())
