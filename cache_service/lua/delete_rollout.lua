-- Delete a rollout and its views (each view is its own hash in the rollout's slot).
-- KEYS[1]  rollout hash
-- Returns  {deleted, memory, blob1, token1, ...}: deleted = the rollout keys deleted (0:
--          there was none); memory = MEMORY USAGE (every field) of the rollout hash and its
--          views' hashes before the delete (-1 when the operator disabled MEMORY); then
--          each shared blob the rollout referenced and its reference token ("" for a
--          reference written before tokens were kept), for the caller to release in the
--          blob's own slot (unref_blob.lua) now that nothing here points at it
local key = KEYS[1]
local function usage(k)
  local m = redis.pcall('MEMORY', 'USAGE', k, 'SAMPLES', '0')
  if type(m) == 'number' then return m end
  if type(m) == 'table' and m.err then return -1 end
  return 0
end
local mem = usage(key)
for _, f in ipairs(redis.call('HKEYS', key)) do
  local serves = string.match(f, '^v:(%d+)$')
  if serves then
    local vkey = key .. ':v:' .. serves
    if mem >= 0 then
      local m = usage(vkey)
      if m < 0 then mem = -1 else mem = mem + m end
    end
    redis.call('DEL', vkey)
  end
end
local out = {0, mem}
for _, f in ipairs(redis.call('HKEYS', key)) do
  local r = string.match(f, '^r:(%d+:%d+)$')
  if r then
    out[#out + 1] = redis.call('HGET', key, f)
    out[#out + 1] = redis.call('HGET', key, 't:' .. r) or ''
  end
end
out[1] = redis.call('DEL', key)
return out
