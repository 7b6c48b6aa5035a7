-- Drop every segment of a rollout that starts at or after a row count (a driver going
-- back to the rows it knows it has; idempotent).
-- KEYS[1]  rollout hash
-- ARGV     rows (>= 1), ttl_ms (0 = no expiry)
-- Returns  {} when the rollout does not exist | {"straddle", "<a>:<b>"} when a segment
--          covers [rows-1, rows] (it cannot be cut without decoding) | {"ok", removed,
--          blob1, token1, ...}: the shared blobs the dropped segments referenced and their
--          reference tokens, released by the caller (delete_rollout.lua)
local key = KEYS[1]
if redis.call('EXISTS', key) == 0 then return {} end
local rows, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local drop = {}
for _, f in ipairs(redis.call('HKEYS', key)) do
  local a, b = string.match(f, '^d:(%d+):(%d+)$')
  if a then
    a = tonumber(a); b = tonumber(b)
    if a < rows and rows < b then return {'straddle', a .. ':' .. b} end
    if a >= rows then drop[#drop + 1] = a .. ':' .. b end
  end
end
local gone, released = {}, {}
for _, r in ipairs(drop) do gone[r] = true end
for _, f in ipairs(redis.call('HKEYS', key)) do
  -- a chunked segment's chunk fields, k:<a>:<b>:... (r3_client/stored/fields.py)
  local a, b = string.match(f, '^k:(%d+):(%d+):')
  if a and gone[a .. ':' .. b] then redis.call('HDEL', key, f) end
end
for _, r in ipairs(drop) do
  -- h:<r> is msgpack [segment, codec, frame bytes, shared] (store/segment_store.py, put_segment).
  local info = cmsgpack.unpack(redis.call('HGET', key, 'h:' .. r))
  redis.call('HINCRBY', key, 'b', -info[3])
  if info[4] then redis.call('HINCRBY', key, 'sb', -info[3]) end
  redis.call('HINCRBY', key, 'n', -1)
  local blob = redis.call('HGET', key, 'r:' .. r)
  if blob then
    released[#released + 1] = blob
    released[#released + 1] = redis.call('HGET', key, 't:' .. r) or ''
  end
  redis.call('HDEL', key, 's:' .. r, 'd:' .. r, 'h:' .. r, 'r:' .. r, 't:' .. r)
end
-- Views serving a dropped segment go with it; the others get the rollout's TTL.
local keys = {key}
for _, f in ipairs(redis.call('HKEYS', key)) do
  local serves = string.match(f, '^v:(%d+)$')
  if serves and tonumber(serves) >= rows then
    redis.call('DEL', key .. ':v:' .. serves)
    redis.call('HDEL', key, f)
  elseif serves then
    keys[#keys + 1] = key .. ':v:' .. serves
  end
end
for _, k in ipairs(keys) do
  if ttl > 0 then redis.call('PEXPIRE', k, ttl) else redis.call('PERSIST', k) end
end
local out = {'ok', #drop}
for _, v in ipairs(released) do out[#out + 1] = v end
return out
