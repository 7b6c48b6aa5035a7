-- Atomically add one segment to a rollout hash.
-- KEYS[1]  rollout hash  (r3:{<rollout_id>})
-- ARGV     meta, start, end, frame, digest, info, ttl_ms, max_segments
-- Fields:  m = rollout meta (E, K, layers; must match across segments)
--          s:<a>:<b> = frame, d:<a>:<b> = content digest, h:<a>:<b> = segment info
--          b = total frame bytes, n = segment count
-- Returns  {"stored"} | {"duplicate"} | {"meta", stored_meta}
--          | {"conflict", "<a>:<b>", "differs"|"overlaps"} | {"full", n}
local key = KEYS[1]
local meta, s, e = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local frame, dig, info = ARGV[4], ARGV[5], ARGV[6]
local ttl, max_segments = tonumber(ARGV[7]), tonumber(ARGV[8])

local function refresh()
  if ttl > 0 then redis.call('PEXPIRE', key, ttl) else redis.call('PERSIST', key) end
end

local cur = redis.call('HGET', key, 'm')
if cur and cur ~= meta then return {'meta', cur} end
for _, f in ipairs(redis.call('HKEYS', key)) do
  local a, b = string.match(f, '^d:(%d+):(%d+)$')
  if a then
    a = tonumber(a); b = tonumber(b)
    if a < e and s < b then
      if a == s and b == e then
        if redis.call('HGET', key, f) == dig then
          refresh()
          return {'duplicate'}
        end
        return {'conflict', a .. ':' .. b, 'differs'}
      end
      return {'conflict', a .. ':' .. b, 'overlaps'}
    end
  end
end
local n = tonumber(redis.call('HGET', key, 'n') or '0')
if n >= max_segments then return {'full', n} end
local r = s .. ':' .. e
redis.call('HSET', key, 'm', meta, 's:' .. r, frame, 'd:' .. r, dig, 'h:' .. r, info)
redis.call('HINCRBY', key, 'b', #frame)
redis.call('HINCRBY', key, 'n', 1)
refresh()
return {'stored'}
