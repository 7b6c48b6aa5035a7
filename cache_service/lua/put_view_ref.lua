-- Register a stored view in its rollout hash (after put_segment.lua stored the view's frame
-- in the view's own hash), and give both keys the same TTL.
-- KEYS[1]  rollout hash, KEYS[2] the view's hash (<rollout hash>:v:<serves>, same slot)
-- ARGV     serves (the row of the segment whose tokens attended to the view), info, ttl_ms
--          info = msgpack [start, end, weight_version, nbytes] of the view's rows
-- Fields:  v:<serves> = info (one field per view; the view's rows live in KEYS[2])
-- Returns  {"ok"}
local key, vkey = KEYS[1], KEYS[2]
local serves, info, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
redis.call('HSET', key, 'v:' .. serves, info)
for _, k in ipairs({key, vkey}) do
  if ttl > 0 then redis.call('PEXPIRE', k, ttl) else redis.call('PERSIST', k) end
end
return {'ok'}
