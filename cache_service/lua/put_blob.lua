-- Store a shareable segment frame once (GRPO prompt dedupe).
-- KEYS[1]  blob hash  (<prefix>[:<namespace>]:blob:{<share key>})
-- ARGV     frame (or its head), content digest, ttl_ms (0 = no expiry; later TTL changes:
--          keep_blob.lua), then the chunk fields' name, bytes pairs of a frame stored chunked
-- Returns  "new" (stored now) | "same" (already there with this content) | "differs"
local key = KEYS[1]
local cur = redis.call('HGET', key, 'd')
if cur == ARGV[2] then
  -- An unchanged write, so a WAIT/WAITAOF after this script covers the stored blob.
  redis.call('HSET', key, 'd', cur)
  return 'same'
end
if cur then return 'differs' end
redis.call('HSET', key, 'f', ARGV[1], 'd', ARGV[2])
for i = 4, #ARGV, 2 do redis.call('HSET', key, ARGV[i], ARGV[i + 1]) end
local ttl = tonumber(ARGV[3])
if ttl > 0 then redis.call('PEXPIRE', key, ttl) end
return 'new'
