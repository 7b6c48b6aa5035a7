-- Reset a rollout's TTL and report the blobs it references (so they can be kept as long).
-- KEYS[1]  rollout hash
-- ARGV     ttl_ms (0 = no expiry)
-- Returns  {} when the rollout does not exist, else {"ok", refs...}
local key = KEYS[1]
if redis.call('EXISTS', key) == 0 then return {} end
local ttl = tonumber(ARGV[1])
local keys = {key}
for _, f in ipairs(redis.call('HKEYS', key)) do
  local serves = string.match(f, '^v:(%d+)$')
  if serves then keys[#keys + 1] = key .. ':v:' .. serves end  -- its views live as long
end
for _, k in ipairs(keys) do
  if ttl > 0 then redis.call('PEXPIRE', k, ttl) else redis.call('PERSIST', k) end
end
local out = {'ok'}
for _, f in ipairs(redis.call('HKEYS', key)) do
  if string.sub(f, 1, 2) == 'r:' then out[#out + 1] = redis.call('HGET', key, f) end
end
return out
