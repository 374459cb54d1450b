"""The Lua scripts of the reliable fetch, and how they are sent.

Each script is one atomic step on the Redis server. ``FETCH`` is what makes a SIGKILL at any
instant harmless: the message leaves its queue only together with its ``unacked`` entry (in
kombu's own format, ``[payload, exchange, routing_key]``) and its place in the incarnation's
holding. It never blocks (a Lua script cannot); the channel waits between empty fetches.
"""

from __future__ import annotations

import hashlib
from typing import Any

#: KEYS: unacked hash, unacked index, this incarnation's holding, the holders registry,
#: then the queue keys in the order BRPOP would try them.
#: ARGV: now (the index score, as kombu's own ``time()``), the incarnation, and one flag
#: per queue key: "1" holds what it pops (consumed with acknowledgements), "0" only pops
#: (a ``no_ack`` consumer: kombu keeps no record of those either).
#: Returns nil, or {position of the key (1-based), the message, 1 if held else 0}.
FETCH = """
local flags = ARGV[3]
for i = 5, #KEYS do
  local item = redis.call('RPOP', KEYS[i])
  if item then
    local n = i - 4
    if string.sub(flags, n, n) ~= '1' then
      return {n, item, 0}
    end
    local ok, m = pcall(cjson.decode, item)
    if ok and type(m) == 'table' and type(m['properties']) == 'table' then
      local p = m['properties']
      local tag = p['delivery_tag']
      local di = p['delivery_info']
      if type(tag) == 'string' and type(di) == 'table' then
        local entry = '[' .. item .. ',' .. cjson.encode(di['exchange']) .. ','
          .. cjson.encode(di['routing_key']) .. ']'
        redis.call('HSET', KEYS[1], tag, entry)
        redis.call('ZADD', KEYS[2], ARGV[1], tag)
        redis.call('SADD', KEYS[3], tag)
        redis.call('ZADD', KEYS[4], ARGV[1], ARGV[2])
        return {n, item, 1}
      end
    end
    -- Not a kombu message (no delivery tag): delivered as BRPOP would, unheld.
    return {n, item, 0}
  end
end
return nil
"""

#: KEYS: a holding, the holders registry. ARGV: the holding's incarnation.
#: Forgets the holder once its holding is empty, atomically with the check, so a message a
#: zombie holds meanwhile keeps its holder registered.
FORGET_EMPTY = """
if redis.call('SCARD', KEYS[1]) == 0 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 1
end
return 0
"""


#: KEYS: unacked hash, unacked index, the incarnation's holding. ARGV: the delivery tag.
#: kombu's ack (both indices) and the holding's, in one command: kombu builds a client and a
#: pipeline for every ack, which costs the worker's event loop more than the round trip.
ACK = """
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
return 1
"""


class Script:
    """A Lua script sent by its SHA1, loaded again after a server restart (NOSCRIPT)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def args(self, keys: list[str], argv: list[Any]) -> list[Any]:
        """The EVALSHA command, for a connection's ``send_command``."""
        return ["EVALSHA", self.sha, len(keys), *keys, *argv]

    def __call__(self, client: Any, keys: list[str], argv: list[Any]) -> Any:
        """Run on a client that adds no key prefix (the keys are prefixed already)."""
        try:
            return client.execute_command(*self.args(keys, argv))
        except Exception as exc:
            if not is_noscript(exc):
                raise
            self.load(client)
            return client.execute_command(*self.args(keys, argv))

    def load(self, client: Any) -> None:
        client.execute_command("SCRIPT", "LOAD", self.source)


def is_noscript(exc: BaseException) -> bool:
    """redis-py raises ``NoScriptError`` (its text without the NOSCRIPT code)."""
    return type(exc).__name__ == "NoScriptError" or str(exc).startswith("NOSCRIPT")


FETCH_SCRIPT = Script(FETCH)
ACK_SCRIPT = Script(ACK)
FORGET_EMPTY_SCRIPT = Script(FORGET_EMPTY)
