"""The Redis index's key layout, and the Lua scripts that change several keys as one.

Keys (all under the configured prefix P):
  P adapter:<name>   hash   the record's fields plus `generation` (its tokenizer files by
                           `files_digest` only: the files are on disk, tokenizer_store.py)
  P names            zset   every name at score 0, so ZRANGEBYLEX pages in name order
  P digests          hash   name -> digest
  P generations      hash   name -> generation (survives delete, so generations never repeat)
  P lru              zset   digest -> last use (unix seconds)
  P lock:<name>      string redis-py Lock held while one registration of <name> fetches
  P events           stream registered / deleted events (XADD MAXLEN ~, `--events-max-len`)
  P events_added     string how many events were ever added (with XLEN: whether any were trimmed;
                           a stream older than the count starts it past its length)
Writes that must agree (record + names + digests + generation + event) run in one Lua script,
and a commit names the generation it started from, so a registration whose lock expired
cannot overwrite a newer one.
"""

from __future__ import annotations

COMMIT_SCRIPT = """
local gen = tonumber(redis.call('HGET', KEYS[6], ARGV[2]) or '0')
if gen ~= tonumber(ARGV[1]) then return -1 end
gen = gen + 1
redis.call('HSET', KEYS[6], ARGV[2], gen)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'generation', gen, unpack(ARGV, 8))
redis.call('ZADD', KEYS[2], 0, ARGV[2])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[3])
-- A stream from before events were counted may have been trimmed: count one more than it holds.
if redis.call('EXISTS', KEYS[7]) == 0 and redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('SET', KEYS[7], redis.call('XLEN', KEYS[5]) + 1)
end
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[5], '*', 'type', 'registered', 'name', ARGV[2],
           'digest', ARGV[3], 'config_digest', ARGV[6], 'files_digest', ARGV[7], 'generation', gen,
           'time', ARGV[4])
redis.call('INCR', KEYS[7])
return gen
"""

DELETE_SCRIPT = """
local digest = redis.call('HGET', KEYS[3], ARGV[1])
if not digest then return false end
local config_digest = redis.call('HGET', KEYS[1], 'config_digest') or ''
local files_digest = redis.call('HGET', KEYS[1], 'files_digest') or ''
local gen = redis.call('HINCRBY', KEYS[6], ARGV[1], 1)
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
-- A stream from before events were counted may have been trimmed: count one more than it holds.
if redis.call('EXISTS', KEYS[7]) == 0 and redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('SET', KEYS[7], redis.call('XLEN', KEYS[5]) + 1)
end
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[3], '*', 'type', 'deleted', 'name', ARGV[1],
           'digest', digest, 'config_digest', config_digest, 'files_digest', files_digest,
           'generation', gen, 'time', ARGV[2])
redis.call('INCR', KEYS[7])
return {digest, gen, files_digest}
"""

# A record of the older format holds its tokenizer files inline (`files_json`): once they are in the
# tokenizer file store, drop them from Redis, unless the record changed meanwhile.
UNINLINE_SCRIPT = """
if redis.call('HGET', KEYS[1], 'generation') ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[1], 'files_digest') ~= ARGV[2] then return 0 end
return redis.call('HDEL', KEYS[1], 'files_json')
"""

RESTORE_SCRIPT = """
local have = tonumber(redis.call('HGET', KEYS[6], ARGV[1]) or '0')
local gen = tonumber(ARGV[3])
if have >= gen and redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[6], ARGV[1], math.max(have, gen))
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('HSET', KEYS[1], 'generation', math.max(have, gen))
redis.call('ZADD', KEYS[2], 0, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[2])
return 1
"""


def record_keys(prefix: str, name: str) -> list[str]:
    """KEYS[1..7] of the scripts above for the record of `name`."""
    p = prefix
    return [
        f"{p}adapter:{name}",
        f"{p}names",
        f"{p}digests",
        f"{p}lru",
        f"{p}events",
        f"{p}generations",
        f"{p}events_added",
    ]
