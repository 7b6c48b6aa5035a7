-- Store a shareable segment frame once (GRPO prompt dedupe) and take a reference to it.
-- KEYS[1]  blob hash  (<prefix>[:<namespace>]:blob:{<share key>})
-- ARGV     frame (or its head), content digest, ttl_ms (0 = no expiry; later TTL changes:
--          keep_blob.lua), reference token, referencing rollout key, then the chunk
--          fields' name, bytes pairs of a frame stored chunked
-- Fields:  f = frame or head, d = content digest, chunk fields, x:<token> = the rollout key
--          holding that reference, rc = how many x: fields there are (unref_blob.lua
--          deletes the blob when it falls to 0)
-- A reference is taken *before* the rollout's field points here and released only after
-- that field is gone, so a blob never disappears under a rollout that points at it.
-- Returns  "new" (stored now) | "same" (already there with this content) | "differs"
--          (another frame under this share key: no reference taken, the caller keeps a
--          private copy)
local key, token = KEYS[1], ARGV[4]
local function take()
  if redis.call('HSETNX', key, 'x:' .. token, ARGV[5]) == 1 then
    redis.call('HINCRBY', key, 'rc', 1)
  end
end
local cur = redis.call('HGET', key, 'd')
if cur == ARGV[2] then
  if redis.call('HEXISTS', key, 'rc') == 0 then
    -- A blob written before references were kept: rollouts point at it holding no token.
    -- One reference stands for them all and is never released, so the blob is left to
    -- its TTL (which every put and touch of a referencing rollout still extends).
    redis.call('HSET', key, 'rc', 1)
  end
  -- Always a write (the reference), so a WAIT/WAITAOF after this script covers the blob.
  take()
  return 'same'
end
if cur then return 'differs' end
redis.call('HSET', key, 'f', ARGV[1], 'd', ARGV[2])
for i = 6, #ARGV, 2 do redis.call('HSET', key, ARGV[i], ARGV[i + 1]) end
take()
local ttl = tonumber(ARGV[3])
if ttl > 0 then redis.call('PEXPIRE', key, ttl) end
return 'new'
