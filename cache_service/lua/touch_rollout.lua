-- Reset a rollout's TTL and report the blobs it references (so they can be kept as long).
-- KEYS[1]  rollout hash
-- ARGV     ttl_ms (0 = no expiry)
-- Returns  {} when the rollout does not exist, else {"ok", refs...}
local key = KEYS[1]
if redis.call('EXISTS', key) == 0 then return {} end
local ttl = tonumber(ARGV[1])
if ttl > 0 then redis.call('PEXPIRE', key, ttl) else redis.call('PERSIST', key) end
local out = {'ok'}
for _, f in ipairs(redis.call('HKEYS', key)) do
  if string.sub(f, 1, 2) == 'r:' then out[#out + 1] = redis.call('HGET', key, f) end
end
return out
