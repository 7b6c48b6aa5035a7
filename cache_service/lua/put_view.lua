-- Atomically store one view (rows an engine call recomputed) and register it in its rollout.
-- KEYS[1]  rollout hash, KEYS[2] the view's hash (<rollout hash>:v:<serves>, same slot)
-- ARGV     meta, serves, start, end, frame, digest, info, ttl_ms, nbytes, ctx_field, ctx,
--          registration, max_views, max_gap, chunk fields...
--          info = the view segment's info (as put_segment.lua's h: fields); registration =
--          msgpack [start, end, weight_version, nbytes] (the rollout's v:<serves> field);
--          max_gap: rows `serves` may lie past the rollout's stored end (the segment it
--          serves obeys the same bound when it is put); chunk fields: name, bytes pairs
--          of a frame stored chunked (frame is then its head), as in put_segment.lua
-- The view's geometry must be the rollout's; a view of a rollout not stored yet (its first
-- call was retracted and re-prefilled) sets the rollout's meta, so every later segment must
-- have the view's geometry.  A view hash holds exactly one segment.  Once a segment starts
-- at `serves` the view is fixed (same rows: duplicate; other rows, or a view where that
-- segment was stored without one: conflict); before that, a view with other rows replaces it.  The rollout and every view of it get ttl_ms.
-- Returns  {"stored", refs...} | {"duplicate", refs...} | {"meta", stored_meta}
--          | {"conflict", "<a>:<b>", "differs"|"overlaps"} | {"gap", stored_end}
--          | {"views", n} | {"unviewed"} (a segment starts at serves, stored without a view)
--          refs = blob keys the rollout's segments reference (the caller refreshes their TTLs)
local key, vkey = KEYS[1], KEYS[2]
local meta, serves = ARGV[1], tonumber(ARGV[2])
local s, e, value, dig, info = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], ARGV[6], ARGV[7]
local ttl, nbytes, ctx_field, ctx = tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[10], ARGV[11]
local reg, max_views, max_gap = ARGV[12], tonumber(ARGV[13]), tonumber(ARGV[14])
local vfield = 'v:' .. ARGV[2]

local cur = redis.call('HGET', key, 'm')
if cur and cur ~= meta then return {'meta', cur} end
local stored_end, fixed, nviews = 0, false, 0
for _, f in ipairs(redis.call('HKEYS', key)) do
  local a, b = string.match(f, '^d:(%d+):(%d+)$')
  if a then
    b = tonumber(b)
    if b > stored_end then stored_end = b end
    if tonumber(a) == serves then fixed = true end
  elseif string.match(f, '^v:%d+$') and f ~= vfield then
    nviews = nviews + 1
  end
end
if serves > stored_end + max_gap then return {'gap', stored_end} end

local function refresh(status)
  local keys = {key}
  local out = {status}
  for _, f in ipairs(redis.call('HKEYS', key)) do
    local v = string.match(f, '^v:(%d+)$')
    if v then
      keys[#keys + 1] = key .. ':v:' .. v
    elseif string.sub(f, 1, 2) == 'r:' then
      out[#out + 1] = redis.call('HGET', key, f)
    end
  end
  for _, k in ipairs(keys) do
    if ttl > 0 then redis.call('PEXPIRE', k, ttl) else redis.call('PERSIST', k) end
  end
  return out
end

local r = s .. ':' .. e
local held = nil
for _, f in ipairs(redis.call('HKEYS', vkey)) do
  local a, b = string.match(f, '^d:(%d+):(%d+)$')
  if a then held = {a .. ':' .. b, f} end
end
if held then
  if held[1] == r and redis.call('HGET', vkey, held[2]) == dig then
    -- Rewrite the (unchanged) registration: a write, so a WAIT/WAITAOF after this script
    -- covers the view an earlier (maybe unconfirmed) put stored (store/durability.py).
    redis.call('HSET', key, 'm', meta, vfield, reg)
    return refresh('duplicate')
  end
  if fixed then
    return {'conflict', held[1], held[1] == r and 'differs' or 'overlaps'}
  end
  redis.call('DEL', vkey)  -- serves no stored segment yet: the retry's rows replace it
elseif fixed then
  return {'unviewed'}  -- its segment was stored (and maybe read) without a view
end
if nviews >= max_views then return {'views', nviews} end
redis.call('HSET', vkey, 'm', meta, 's:' .. r, value, 'd:' .. r, dig, 'h:' .. r, info,
           'b', nbytes, 'n', 1)
for i = 15, #ARGV, 2 do redis.call('HSET', vkey, ARGV[i], ARGV[i + 1]) end
if ctx_field ~= '' then redis.call('HSET', vkey, ctx_field, ctx) end
redis.call('HSET', key, 'm', meta, vfield, reg)
return refresh('stored')
