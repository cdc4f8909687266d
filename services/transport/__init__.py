"""Redis as kvledger uses it: building clients (`redis_client`), a private redis-server
(`redis_server`), every key's name (`keys`), the streams transport with consumer groups and
dead letters (`streams`), and worker registration through expiring keys (`registry`).
"""
