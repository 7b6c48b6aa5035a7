-- Keep a shared blob alive at least as long as a rollout that references it.
-- KEYS[1]  blob hash
-- ARGV     ttl_ms of the referencing rollout (0 = that rollout never expires)
-- A blob's TTL only ever grows (another rollout may need it longer); 0 persists it.
-- Returns  1 if the blob exists, else 0
local key = KEYS[1]
local ttl = tonumber(ARGV[1])
local p = redis.call('PTTL', key)
if p == -2 then return 0 end
if ttl == 0 then
  redis.call('PERSIST', key)
elseif p ~= -1 and p < ttl then
  redis.call('PEXPIRE', key, ttl)
end
return 1
