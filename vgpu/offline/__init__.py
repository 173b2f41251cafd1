"""Offline tools the daemon never imports: trace conversion, training, evaluation, splits and the
slowdown research. Only they and the manager import torch.
"""
