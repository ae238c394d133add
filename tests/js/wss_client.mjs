// MQTT.js over wss:// against an edge (tests/e2e/test_edge_tls_clients.py).
// usage: node wss_client.mjs URL CA_FILE USERNAME
// Subscribes to fleet/js/in, says {"subscribed": true}, publishes "hello from mqtt.js" on
// fleet/js/out at QoS 1, says {"published": true} once acknowledged, then waits for one message on
// fleet/js/in, says {"received": PAYLOAD} and exits 0. Any error or 20 s: {"error": ...}, exit 1.
import { readFileSync } from "node:fs";
import mqtt from "mqtt";

const [url, caFile, username] = process.argv.slice(2);
const say = (what) => console.log(JSON.stringify(what));
const fail = (why) => {
  say({ error: String(why) });
  process.exit(1);
};
setTimeout(() => fail("timed out"), 20000);

const client = mqtt.connect(url, {
  ca: readFileSync(caFile),
  rejectUnauthorized: true,
  username,
  clientId: `mqttjs-${process.pid}`,
  protocolVersion: 5,
  reconnectPeriod: 0,
});
client.on("error", fail);
client.on("message", async (topic, payload) => {
  say({ received: payload.toString(), topic });
  await client.endAsync();
  process.exit(0);
});
client.on("connect", async () => {
  try {
    await client.subscribeAsync("fleet/js/in", { qos: 1 });
    say({ subscribed: true });
    await client.publishAsync("fleet/js/out", "hello from mqtt.js", { qos: 1 });
    say({ published: true });
  } catch (err) {
    fail(err);
  }
});
