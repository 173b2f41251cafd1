"""Mechanisms: the writes that enforce a plan on a device (power limit, MIG layout, per-application
memory and SM limits), each check -> change -> verify, with the original saved first.
"""
