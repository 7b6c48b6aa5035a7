-- Drop a rollout whole if every row it holds was computed under a weight version <= upto.
-- KEYS[1]  rollout hash
-- ARGV[1]  upto: a decimal integer (at most 15 digits, exact in Lua's doubles)
-- A rollout is dropped only when every segment's and every view's weight version is a
-- decimal integer <= upto; the check and the delete are one script, so a writer racing
-- the drop either lands first (the rollout is then kept, or dropped with its rows) or
-- finds the rollout gone: never half a rollout.
-- Returns  {1, memory, blob1, token1, ...}  dropped (memory: MEMORY USAGE of the rollout
--                       and its views' hashes before the delete, -1 when MEMORY is
--                       disabled; then each shared blob it referenced and the token of
--                       that reference, released by the caller: delete_rollout.lua)
--          {0, 0}       no such rollout (expired, deleted, or dropped by a racing call)
--          {-1, newest} kept: a segment or view is newer than upto (newest, a string)
--          {-2, 0}      kept: a weight version that is not a decimal integer, or a
--                       segment info or view registration that does not parse
local key, upto = KEYS[1], tonumber(ARGV[1])
local kind = redis.call('TYPE', key)['ok']
if kind == 'none' then return {0, 0} end
if kind ~= 'hash' then return {-2, 0} end  -- not a rollout the store wrote: kept
local fields = redis.call('HKEYS', key)
if #fields == 0 then return {0, 0} end
local newest, views = -1, {}
local function version(v)
  if type(v) ~= 'string' or not string.match(v, '^%d+$') or #v > 15 then return nil end
  return tonumber(v)
end
-- A record that does not parse (damaged in Redis) shows no version: its rollout is kept,
-- counted with the unversioned, and the walk goes on.
local function record(f)
  local ok, rec = pcall(cmsgpack.unpack, redis.call('HGET', key, f))
  if ok and type(rec) == 'table' then return rec end
  return {}
end
for _, f in ipairs(fields) do
  local v, serves = nil, string.match(f, '^v:(%d+)$')
  if serves then
    views[#views + 1] = key .. ':v:' .. serves
    v = version(record(f)[3])
  elseif string.sub(f, 1, 2) == 'h:' then
    local seg = record(f)[1]
    v = version(type(seg) == 'table' and seg['weight_version'] or nil)
  else
    v = newest
  end
  if v == nil then return {-2, 0} end
  if v > newest then newest = v end
end
if newest > upto then return {-1, string.format('%d', newest)} end
local function usage(k)
  local m = redis.pcall('MEMORY', 'USAGE', k, 'SAMPLES', '0')
  if type(m) == 'number' then return m end
  if type(m) == 'table' and m.err then return -1 end
  return 0
end
local mem = usage(key)
for _, vkey in ipairs(views) do
  if mem >= 0 then
    local m = usage(vkey)
    if m < 0 then mem = -1 else mem = mem + m end
  end
  redis.call('DEL', vkey)
end
local out = {1, mem}
for _, f in ipairs(fields) do
  local r = string.match(f, '^r:(%d+:%d+)$')
  if r then
    out[#out + 1] = redis.call('HGET', key, f)
    out[#out + 1] = redis.call('HGET', key, 't:' .. r) or ''
  end
end
redis.call('DEL', key)
return out
