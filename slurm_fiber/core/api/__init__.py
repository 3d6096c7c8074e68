"""fiberd's local socket API: framing, protocol, server, client and socket discovery.  The server
(``server.ApiServer``) serves a ``service.Service`` that the core runtime implements;
``client.FiberdClient`` is the blocking client fiberctl uses. The wire protocol is documented in
docs/socket-protocol.md.
"""
