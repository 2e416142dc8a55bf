"""Side-by-side benchmarking: one timing harness shared by every backend's contenders."""

from ._timing import Result, print_table, time_call, write_json

__all__ = ["Result", "print_table", "time_call", "write_json"]
