"""Policy: pure planning from forecasts, requests and priorities to targets (grants, power limits,
MIG layouts). No I/O; the mechanisms apply what a policy plans.
"""
