"""Choosing a replica: the policy that scores replicas by cached prefix and load (`policy`,
pure) and the live view of every replica's events and status it scores over (`replicas`).
"""
